"""The systems bench_cuda.py measures, one module each, registered here.

Adding a system: a module in this folder with an Adapter subclass
(harness.Adapter says what each method does) and its line below.
"""
import importlib
from collections import namedtuple

# label: the row of the tables; adapter: "module:Class" in this folder;
# kwargs: the class's keyword arguments; env: set in the system's processes.
Peer = namedtuple("Peer", "label adapter kwargs env", defaults=({}, {}))

# The systems, in the tables' row order ("all" runs them).
REGISTRY = {
    "usmipc-fd": Peer("usmipc (fd / VMM)", "usmipc:UsmipcAdapter",
                      {"kind": "fd"}, {"USMIPC_CUDA_IPC": "fd"}),
    "usmipc-native": Peer("usmipc (native / legacy)", "usmipc:UsmipcAdapter",
                          {"kind": "native"}, {"USMIPC_CUDA_IPC": "native"}),
    "cupy": Peer("CuPy raw cudaIpc*", "cupy:CupyAdapter"),
    "torch": Peer("PyTorch reduce_tensor", "torch:TorchAdapter"),
    "cuda.core": Peer("cuda.core mempool IPC", "cuda_core:CudaCoreAdapter"),
    "staged": Peer("host-staged copy (D2H+shm+H2D)", "staged:StagedAdapter"),
}
# Not in the default run: host shared memory standing in for a GPU system, so
# that --selftest can drive the real producer/consumer machinery without CUDA.
HIDDEN_REGISTRY = {
    "mock": Peer("mock (host shm; selftest only)", "mock:MockAdapter"),
}

# key -> row label
SYSTEMS = {k: p.label for k, p in REGISTRY.items()}
HIDDEN_SYSTEMS = {k: p.label for k, p in HIDDEN_REGISTRY.items()}
ALIASES = {"usmipc": ["usmipc-fd", "usmipc-native"], "all": list(SYSTEMS),
           "cuda_core": ["cuda.core"], "cudacore": ["cuda.core"],
           "pytorch": ["torch"], "host-staged": ["staged"]}


def _peer(system):
    return REGISTRY.get(system) or HIDDEN_REGISTRY.get(system)


def label(system):
    return SYSTEMS.get(system) or HIDDEN_SYSTEMS.get(system, system)


def adapter_class(system):
    """The system's Adapter subclass, or None for an unknown key."""
    peer = _peer(system)
    if peer is None:
        return None
    module, name = peer.adapter.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def make_adapter(system, cfg):
    cls = adapter_class(system)
    if cls is None:
        raise ValueError(system)
    return cls(cfg, **_peer(system).kwargs)


def system_env(system):
    """Environment variables the system's producer (and its consumer) run with."""
    peer = _peer(system)
    return dict(peer.env) if peer else {}


def parse_systems(text):
    out = []
    for t in (x.strip() for x in text.split(",")):
        if not t:
            continue
        keys = ALIASES.get(t, [t])
        for k in keys:
            if k not in SYSTEMS and k not in HIDDEN_SYSTEMS:
                raise ValueError(f"unknown system {t!r}; known: {', '.join(SYSTEMS)}")
            if k not in out:
                out.append(k)
    return out
