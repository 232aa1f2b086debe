"""How the ``mmformer`` process ends (``cli.run``): after a distributed run it skips interpreter
finalization (gloo's threads can abort a finished run there), yet keeps the command's exit code, runs
the exit handlers and loses no buffered output. Real processes, a real gloo process group."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import atexit, sys, types
    import torch.distributed as dist
    from mmformer import cli

    store = sys.argv[1]

    def cmd_info(args):
        if {distributed}:
            dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
            dist.all_reduce(__import__("torch").ones(3))
        atexit.register(lambda: print("exit handler ran"))
        sys.stdout.write("written, not flushed")
        return 3

    sys.modules["mmformer.commands.info"] = types.SimpleNamespace(cmd_info=cmd_info)
    sys.argv = ["mmformer", "info", "any.yaml"]
    cli.run()
    print("never reached")
    """
)


@pytest.mark.parametrize("distributed", [True, False])
def test_the_process_keeps_its_exit_code_handlers_and_output(tmp_path, distributed):
    script = SCRIPT.format(distributed=distributed)
    res = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "store")], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 3, res.stderr[-2000:]
    assert "written, not flushed" in res.stdout and "exit handler ran" in res.stdout
    assert "never reached" not in res.stdout
