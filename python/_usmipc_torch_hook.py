"""The switch behind USMIPC_TORCH=1 (usmipc-torch.pth runs arm() at
interpreter start when the variable is set, and nothing else otherwise).

It imports neither torch nor usmipc: it waits, as a finder on
sys.meta_path, for the program's first import of torch.multiprocessing,
and right after torch's own module has run (its reductions registered)
installs usmipc's (usmipc.torch.install()). Spawned and forkserver
children start a new interpreter and arm again from the same variable;
forked ones inherit what their parent installed.
"""

import importlib.machinery
import sys

_TARGET = "torch.multiprocessing"


class _Loader:
    """torch.multiprocessing's own loader, then usmipc.torch.install()."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            import usmipc.torch

            usmipc.torch.install()
        except Exception as e:  # torch must still import
            print(f"usmipc: USMIPC_TORCH is set but usmipc.torch.install() "
                  f"failed: {type(e).__name__}: {e}; torch keeps its own "
                  f"CUDA sharing", file=sys.stderr)

    def __getattr__(self, name):  # get_code, is_package, get_resource_reader
        return getattr(self._loader, name)


class _Finder:
    """Finds torch.multiprocessing as the path finder does, with its
    loader wrapped; steps aside after that one import."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != _TARGET:
            return None
        disarm()
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def arm():
    """Installs usmipc's reducers once torch.multiprocessing is imported
    (at once if it already is)."""
    if _TARGET in sys.modules:
        import usmipc.torch

        usmipc.torch.install()
        return
    if _Finder not in sys.meta_path:
        sys.meta_path.insert(0, _Finder)


def disarm():
    while _Finder in sys.meta_path:
        sys.meta_path.remove(_Finder)
