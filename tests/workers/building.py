"""Worker for tests/test_build_caches.py: builds a small C++ extension as DeepSpeed builds its ops
(``torch.utils.cpp_extension.load``), and says where torch put the build."""

from pathlib import Path

SOURCE = """
#include <Python.h>
static struct PyModuleDef probe = {PyModuleDef_HEAD_INIT, "probe_ext", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit_probe_ext(void) { return PyModule_Create(&probe); }
"""


def build(ctx, folder: str):
    from torch.utils import cpp_extension

    source = Path(folder, "probe_ext.cpp")
    source.write_text(SOURCE)
    module = cpp_extension.load(name="probe_ext", sources=[str(source)], verbose=False)
    return str(Path(module.__file__).parent)
