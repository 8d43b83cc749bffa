"""The README stays true: every worker flag is documented, CI runs exactly the README's commands,
and the torchrun settings it shows are the ones the launcher uses."""

import re
from dataclasses import fields

from conftest import REPO
from elastic_mnist.config import TrainConfig
from elastic_mnist.torchrun_settings import MAX_RESTARTS, MONITOR_INTERVAL, rdzv_conf

README = (REPO / "README.md").read_text()
CI = (REPO / ".ci" / "run").read_text()


def test_every_train_flag_is_in_the_readme_table():
    for f in fields(TrainConfig):
        assert f"| `--{f.name.replace('_', '-')}` |" in README, f.name


def test_ci_runs_the_readmes_install_and_test_commands():
    quickstart = re.findall(r"^    (python3 -m venv .*)$", README, re.M)
    assert len(quickstart) == 2, "two quickstart commands"
    install = quickstart[1].split(" && ", 2)[2].rsplit(" && ", 1)[0]
    test_cmd = quickstart[1].rsplit(" && ", 1)[1]
    assert install in CI and test_cmd in CI
    assert quickstart[0].startswith(quickstart[1].rsplit(" && ", 1)[0]), "both install the same way"


def test_readme_torchrun_settings_match_the_code():
    assert f"--rdzv-conf={rdzv_conf('etcd-v3')}" in README
    assert f"--rdzv-conf={rdzv_conf('etcd')}" in README
    assert f"--max-restarts={MAX_RESTARTS}" in README and f"--monitor-interval={MONITOR_INTERVAL}" in README
