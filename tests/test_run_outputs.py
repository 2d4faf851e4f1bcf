"""Issue 41 items 5 and 6: what a run leaves for a researcher, and the logs around it.

One shrunk demo run (tests/train_helpers.py FAST_DEMO_FLAGS, without its warm-start: the outputs are RL's and
the evaluations') with a periodic evaluation at each of its 2 RL steps: TensorBoard holds every evaluation's
pass@k and mean@n (as pass_at_k, mean_at_n: tags take
no "@"; the periodic ones under eval/, the
final settings' under eval_final/ at step 0 and the last step), equal to the eval_metrics.json files
the evaluations wrote; curves.png is written. The export of its workdir logs no Orbax warning and
its bar ends on one 100 % line.
"""

from __future__ import annotations

import json
import pathlib
import struct
import subprocess
import sys

import pytest
from tensorboardX.proto import event_pb2

from train_helpers import (FAST_DEMO_FLAGS, NO_WARMSTART_FLAGS, REPO, compile_cache_dir, finish, logs, start_train,
                           train_env)


def _scalars(folder: pathlib.Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of every TensorBoard events file in ``folder`` (TFRecord framing: length,
    its CRC, the Event, the Event's CRC)."""
    out: dict[str, dict[int, float]] = {}
    for path in sorted(folder.iterdir()):
        data, position = path.read_bytes(), 0
        while position < len(data):
            (length,) = struct.unpack("<Q", data[position:position + 8])
            event = event_pb2.Event.FromString(data[position + 12:position + 12 + length])
            position += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


@pytest.mark.slow(seconds=70)
def test_every_evaluation_is_in_tensorboard_and_the_export_logs_are_quiet(tmp_path_factory):
    env = train_env(compile_cache_dir())
    workdir = tmp_path_factory.mktemp("outputs") / "run"
    process = start_train(workdir, *FAST_DEMO_FLAGS, *NO_WARMSTART_FLAGS, "--config.train.steps=2",
                          "--config.eval.periodic.every=1",
                          "--config.eval.periodic.n=2", "--config.eval.periodic.temperature=1.0", env=env,
                          log_name="run")
    assert finish(process) == 0, logs(workdir, "run")[-3000:]

    scalars = _scalars(workdir / "tensorboard")
    for folder, tag, step in (("step_1", "eval", 1), ("step_2", "eval", 2), ("before_rl", "eval_final", 0),
                              ("final", "eval_final", 2), ("final_greedy", "eval_final_greedy", 2)):
        written = json.loads((workdir / "eval" / folder / "eval_metrics.json").read_text())
        assert set(written) == {"held_out"}
        for key, value in written["held_out"].items():
            assert scalars[f"{tag}/held_out/{key.replace('@', '_at_')}"][step] == pytest.approx(value), (folder, key)
    assert set(scalars["eval/held_out/pass_at_2"]) == {1, 2}  # the periodic ones only
    assert set(scalars["loss"]) == {1, 2}  # the training metrics beside them
    assert (workdir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    export = subprocess.run([sys.executable, str(REPO / "tools" / "export_hf.py"), f"--checkpoint={workdir}",
                             f"--out={workdir.parent / 'export'}"], capture_output=True, text=True, timeout=300,
                            env=env)
    assert export.returncode == 0, export.stderr[-3000:]
    assert "Metadata file does not exist" not in export.stderr and "W1" not in export.stderr, export.stderr
    finished = [line for line in export.stderr.splitlines() if line.startswith("exporting to export: 100%")]
    assert len(finished) == 1, export.stderr
