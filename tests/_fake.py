"""Host memory dressed as a device array (shape/dtype/strides + __cuda_array_interface__, like a
Numba device array), so argument validation can be tested on machines without a GPU. Nothing
built from these is ever launched: every test using them expects an error before the launch."""
import numpy as np


class FakeDeviceArray(np.ndarray):
    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ctypes.data, False),
                "version": 3, "strides": self.strides}

    def copy_to_host(self):
        return np.array(self.view(np.ndarray))


def dev(a: np.ndarray) -> FakeDeviceArray:
    """A 64-byte aligned fake device copy of ``a``."""
    a = np.asarray(a)
    buf = np.empty(a.nbytes + 64, np.uint8)
    off = (-buf.ctypes.data) % 64
    out = buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out.view(FakeDeviceArray)
