"""Backends: what each one tells the launcher and the loop, and how each fails where its runtime is absent."""

from __future__ import annotations

import importlib.util
import socket

import pytest
import torch
import torch.distributed as dist

from trainer.backends import CHIPS, chips_for, get_backend, get_chip
from trainer.backends.base import BackendUnavailable
from trainer.backends.cpu import CPUBackend

BACKENDS = {
    # name: (torch device type, process-group backend, a variable its launch env must set)
    "cpu": ("cpu", "gloo", "OMP_NUM_THREADS"),
    "gpu": ("cuda", "nccl", "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
    "tpu": ("tpu", "tpu_dist", None),  # TorchTPU reads GKE's own variables
    "trainium": ("neuron", "neuron", "NEURON_RT_NUM_CORES"),
}
RUNTIME_PRESENT = {
    "cpu": True,
    "gpu": torch.cuda.is_available(),
    "tpu": importlib.util.find_spec("torch_tpu") is not None,
    "trainium": importlib.util.find_spec("torch_neuronx") is not None,
}


@pytest.mark.parametrize("name", BACKENDS)
def test_backend_identity_and_launch_env(name: str) -> None:
    backend = get_backend(name)
    device_type, dist_backend, env_var = BACKENDS[name]
    assert (backend.name, backend.device_type, backend.dist_backend) == (name, device_type, dist_backend)
    env = backend.launch_env(chips_per_node=16)
    assert (env_var is None or env_var in env) and all(isinstance(v, str) for v in env.values())


def test_trainium_launch_env_counts_neuron_cores_per_process() -> None:
    assert (
        get_backend("trainium").launch_env(chips_per_node=16)["NEURON_RT_NUM_CORES"] == "8"
    )  # one Trainium2 chip per process, not the host's 128 cores for each of 16 processes


@pytest.mark.parametrize("name", [n for n in BACKENDS if n != "cpu"])
def test_require_explains_how_to_install_a_missing_runtime(name: str) -> None:
    if RUNTIME_PRESENT[name]:
        pytest.skip(f"the {name} runtime is installed here")
    backend = get_backend(name)
    assert not backend.is_available()
    with pytest.raises(BackendUnavailable, match=rf"backend '{name}' is not available here: .*") as err:
        backend.require()
    assert backend.install_hint and backend.install_hint in str(err.value)


@pytest.mark.parametrize("name", ["tpu", "trainium"])
def test_plugin_runtime_is_named_when_missing(name: str) -> None:
    """TorchTPU is ``torch_tpu`` and TorchNeuron is ``torch_neuronx``: the error names the import."""
    if RUNTIME_PRESENT[name]:
        pytest.skip(f"the {name} runtime is installed here")
    module = {"tpu": "torch_tpu", "trainium": "torch_neuronx"}[name]
    with pytest.raises(BackendUnavailable, match=rf"^{module} is not installed: "):
        get_backend(name).device(0)


def test_unknown_accelerator_and_chip_name_the_choices() -> None:
    with pytest.raises(ValueError, match="choose one of cpu, gpu, tpu, trainium"):
        get_backend("fpga")
    with pytest.raises(ValueError, match="known chips: cpu, a100-80gb"):
        get_chip("h1000")


@pytest.mark.parametrize("name", CHIPS)
def test_chip_catalog_is_consistent(name: str) -> None:
    chip = CHIPS[name]
    backend = get_backend(chip.accelerator)  # every chip's accelerator has a backend
    assert backend.chip(name) is chip and name in chips_for(chip.accelerator)
    other = next(n for n, c in CHIPS.items() if c.accelerator != chip.accelerator)
    with pytest.raises(ValueError, match=f"is a {CHIPS[other].accelerator} chip, not {chip.accelerator}"):
        backend.chip(other)
    assert chip.hbm_bytes > 0 and chip.hbm_bandwidth > 0 and chip.peak_bf16_flops > 0
    assert chip.peak_fp8_flops is None or chip.peak_fp8_flops > chip.peak_bf16_flops
    # the scale-up link is faster than the scale-out network, and a node fits in its domain
    assert chip.intra_bandwidth > chip.inter_bandwidth > 0 and chip.intra_latency_s <= chip.inter_latency_s
    assert chip.domain_chips >= chip.chips_per_node >= 1 and 0 < chip.failures_per_chip_hour < 1e-3


def test_every_accelerator_has_chips() -> None:
    assert {c.accelerator for c in CHIPS.values()} == set(BACKENDS)
    assert all(chips_for(name) for name in BACKENDS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cpu_backend_initializes_a_real_gloo_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        **CPUBackend().launch_env(chips_per_node=1),
    }.items():
        monkeypatch.setenv(key, value)
    backend = get_backend("cpu")
    backend.require()
    backend.init_process_group(timeout_s=30)
    try:
        assert dist.get_backend() == "gloo" and dist.get_world_size() == 1
        assert backend.device(local_rank=0) == torch.device("cpu")
        tensor = torch.tensor([3.0])
        dist.all_reduce(tensor)
        assert tensor.item() == 3.0
        backend.init_process_group(timeout_s=30)  # idempotent: a second call keeps the group
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
