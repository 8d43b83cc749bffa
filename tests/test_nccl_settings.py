"""NCCL's error handling under a real torchrun: the agent passes its own value to every worker, and the
worker replaces it with the mode its failure path needs before any NCCL group exists (a GPU-less check:
the setting is made, and reported once, by the code distributed.init runs for nccl)."""

import pytest
from conftest import run_torchrun

from elastic_mnist.distributed import NCCL_ERROR_HANDLING, NCCL_ERROR_HANDLING_ENV, set_nccl_error_handling

# Both workers share torchrun's stdout: each line goes out in one write(2), so that the two cannot
# interleave inside a line (print writes its arguments one by one when stdout is unbuffered).
WORKER = f"""
import os
from elastic_mnist.distributed import set_nccl_error_handling
os.write(1, f"agent passed {{os.environ.get('{NCCL_ERROR_HANDLING_ENV}')}}\\n".encode())
set_nccl_error_handling(os.environ, os.environ["LOCAL_RANK"] == "0")
os.write(1, f"worker runs with {{os.environ['{NCCL_ERROR_HANDLING_ENV}']}}\\n".encode())
"""


@pytest.mark.slow  # a real torchrun
def test_a_worker_started_by_torchrun_runs_nccl_in_the_mode_its_failure_path_needs(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    run = run_torchrun(["--standalone", "--nproc-per-node=2"], [], script=str(script))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("agent passed 1") == 2, "torchrun's agent sets TearDown for every worker"
    assert run.stdout.count(f"worker runs with {NCCL_ERROR_HANDLING}") == 2
    assert run.stderr.count("replaced by 2 (CleanUpOnly)") == 1, "said once, by local rank 0"


def test_a_value_already_right_is_left_without_a_word(capsys):
    environ = {NCCL_ERROR_HANDLING_ENV: NCCL_ERROR_HANDLING}
    set_nccl_error_handling(environ)
    assert environ[NCCL_ERROR_HANDLING_ENV] == "2" and capsys.readouterr().err == ""
