"""Accelerate users: their `accelerate config` DeepSpeed YAML converts into a zerospeed config, and
`accelerate launch` starts a zerospeed script on 2 processes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zerospeed.integrations.accelerate import from_accelerate
from zerospeed.launcher.cli import main as cli

SCRIPT = Path(__file__).parent / "scripts" / "accelerate_train.py"
YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  gradient_accumulation_steps: 2
  gradient_clipping: 1.0
  offload_optimizer_device: cpu
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 2
mixed_precision: 'no'
num_machines: 1
num_processes: 2
"""


def test_convert_accelerate_yaml(tmp_path, capsys) -> None:
    (tmp_path / "acc.yaml").write_text(YAML)
    assert cli(["convert-accelerate", str(tmp_path / "acc.yaml"), str(tmp_path / "ds.json"), "--micro-batch", "2"]) == 0
    cfg = json.loads((tmp_path / "ds.json").read_text())
    assert cfg == {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                   "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 2}
    assert "zerospeed launch --nproc-per-node 2 your_script.py" in capsys.readouterr().out


def test_convert_refuses_what_it_cannot_map(tmp_path) -> None:
    with pytest.raises(ValueError, match="deepspeed_config.zero_stag: unknown"):
        from_accelerate({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stag": 3}})
    with pytest.raises(ValueError, match="not DEEPSPEED"):
        from_accelerate({"distributed_type": "FSDP"})
    with pytest.raises(ValueError, match="offload_param_device is 'gpu'"):
        from_accelerate({"deepspeed_config": {"offload_param_device": "gpu"}})
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3}}')
    cfg, flags, _ = from_accelerate({"deepspeed_config": {"deepspeed_config_file": str(tmp_path / "ds.json"),
                                                          "deepspeed_multinode_launcher": "standard"},
                                     "num_processes": 4, "num_machines": 2, "mixed_precision": "bf16"})
    assert cfg == {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    assert flags == ["--nproc-per-node", "2", "--nnodes", "2", "--launcher", "ssh"]
    with pytest.raises(ValueError, match="must not be"):
        from_accelerate({"deepspeed_config": {"deepspeed_config_file": str(tmp_path / "ds.json"), "zero_stage": 2}})


@pytest.mark.skipif(shutil.which("accelerate") is None and not Path(sys.executable).with_name("accelerate").exists(),
                    reason="accelerate is not installed")
def test_accelerate_launch_runs_a_zerospeed_script(tmp_path) -> None:
    (tmp_path / "acc.yaml").write_text(YAML)
    assert cli(["convert-accelerate", str(tmp_path / "acc.yaml"), str(tmp_path / "ds.json"), "--micro-batch", "2"]) == 0
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).with_name("accelerate")
    # `--multi_gpu` is Accelerate's torchrun launcher; it starts CPU processes too (its `--cpu` runs one process
    # unless MPI is given). The script is zerospeed's: on CPU it joins with Gloo.
    cmd = [str(exe), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--main_process_port",
           str(port), str(SCRIPT), str(tmp_path / "ds.json")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    results = sorted((json.loads(p.read_text()) for p in tmp_path.glob("result_*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1] and all(r["world"] == 2 for r in results)
    assert [r["local_rank"] for r in results] == [0, 1] and all((r["stage"], r["gas"]) == (2, 2) for r in results)
    assert all(len(r["losses"]) == 3 for r in results)
