"""FAKE cupy.cuda.runtime."""
import os


def getDeviceCount():
    return int(os.environ.get("FAKE_CUPY_DEVICES", "2"))


def getDeviceProperties(device):
    return {"name": b"Fake GPU (NumPy)"}
