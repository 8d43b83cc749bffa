"""The docs stay true: the flag reference is generated from the config, CI runs exactly the README's
commands, the torchrun settings shown are the ones the code uses, and every link resolves."""

import re

from conftest import REPO

from elastic_mnist.config import flags_markdown
from elastic_mnist.contract.torchrun import MAX_RESTARTS, MONITOR_INTERVAL, RDZV_CONF, rdzv_conf

README = (REPO / "README.md").read_text()
CI = (REPO / ".ci" / "run").read_text()


def _blocks(text: str, lang: str = "bash") -> list[str]:
    """Fenced code blocks, with `\\` continuations joined into one command line each."""
    return [b.replace("\\\n", " ") for b in re.findall(rf"```{lang}\n(.*?)```", text, re.S)]


def test_flag_reference_is_generated_from_the_config():
    assert (REPO / "docs" / "flags.md").read_text() == flags_markdown(), (
        "run: python -m elastic_mnist.config > docs/flags.md")


def test_ci_runs_the_readmes_install_and_test_commands():
    quickstart = _blocks(README)[0]
    install = next(line for line in quickstart.splitlines() if line.startswith("pip install"))
    assert install in CI
    tests = _blocks(README[README.index("## Tests"):README.index("## More")])
    commands = [line.split("  #")[0].strip() for block in tests for line in block.splitlines()]
    assert len(tests) == 2 and "ruff check ." in commands, "the lint, the suite, the oldest torch's fast tier"
    ci_lines = [line.split("  #")[0].strip() for line in CI.splitlines()]
    assert [c for c in commands if c and c not in ci_lines] == [], "CI runs every test command, verbatim"


def test_readme_torchrun_commands_match_the_code():
    commands = [c for c in _blocks(README) if c.startswith("torchrun")]
    v3 = next(c for c in commands if "--rdzv-backend=etcd-v3" in c)
    legacy = next(c for c in commands if "--rdzv-backend=etcd " in c)
    assert "--rdzv-conf" not in v3, "etcd-v3's defaults are the tuned values"
    assert f"--rdzv-conf={rdzv_conf('etcd')}" in legacy
    for c in (v3, legacy):
        assert f"--max-restarts={MAX_RESTARTS}" in c and f"--monitor-interval={MONITOR_INTERVAL}" in c
    assert RDZV_CONF["etcd-v3"]["keep_alive_max_attempt"] >= 1


def test_readme_is_short_and_every_doc_link_resolves():
    assert len(README.encode()) <= 10_000
    for path in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#]+?)(?:#[^)]*)?\)", path.read_text()):
            if not target.startswith("http"):
                assert (path.parent / target).exists(), f"{path.name}: broken link {target}"


def test_user_docs_name_no_internal_issue_numbers():
    for path in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        assert not re.search(r"\b[Ii]ssue \d+\b", path.read_text()), path.name
