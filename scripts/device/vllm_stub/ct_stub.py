# A stand-in for the `compressed_tensors` package, which the peer kit lacks and vLLM 0.24's
# quantization registry imports (auto_awq -> fused_moe int_wna16) even for `quantization="fp8"`.
# Every module under it exists and every name in it is an inert class.
import sys, types, importlib.abc, importlib.machinery

class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls
    def __iter__(cls):
        return iter(())
    def __or__(cls, other):
        return cls
    __ror__ = __or__
    def __getitem__(cls, item):
        return cls

class _Stub(metaclass=_Meta):
    def __init__(self, *a, **k):
        pass

class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub

class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "compressed_tensors" or name.startswith("compressed_tensors."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None
    def create_module(self, spec):
        m = _Module(spec.name)
        m.__path__ = []
        return m
    def exec_module(self, module):
        pass

sys.meta_path.insert(0, _Finder())
