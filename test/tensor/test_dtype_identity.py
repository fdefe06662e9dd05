"""One DType instance per value: equal dtypes, however made, are the same object (equality is identity)."""
import copy
import gc
import pickle
import threading
import weakref
from fusegrad.dtype import DType, PtrDType, dtypes

def test_equal_dtypes_are_one_object():
    assert DType.new(11, 4, "float", "f") is dtypes.float32
    assert DType(11, 4, "float", "f", 1, None) is dtypes.float32   # every field given
    assert dtypes.float32.vec(4) is dtypes.float32.vec(4)
    assert dtypes.half.ptr(16) is dtypes.half.ptr(16) and dtypes.half.ptr(16) is not dtypes.half.ptr(17)
    assert dtypes.int32.ptr(8, "local") is not dtypes.int32.ptr(8)
    assert dtypes.float32.ptr(8).vec(4).scalar() is dtypes.float32.ptr(8)
    for dt in (dtypes.bool, dtypes.bfloat16, dtypes.float32.vec(3), dtypes.uint8.ptr(5), dtypes.index):
        assert pickle.loads(pickle.dumps(dt)) is dt and copy.copy(dt) is dt and copy.deepcopy(dt) is dt

def test_equality_and_hash():
    assert dtypes.float32 == dtypes.float32 and dtypes.float32 != dtypes.int32
    assert dtypes.float32 != "float" and dtypes.float32 != 4
    assert dtypes.float32.ptr(4) != dtypes.float32 and isinstance(dtypes.float32.ptr(4), PtrDType)
    d = {dtypes.float32.ptr(3): 1}
    assert d[dtypes.float32.ptr(3)] == 1 and len({dtypes.int8.vec(2), dtypes.int8.vec(2), dtypes.int8}) == 2

def test_threads_get_one_instance():
    # threads making one new dtype at the same moment all get the same object
    made: list = []
    start = threading.Barrier(8)
    def work():
        start.wait()
        made.append(dtypes.float64.ptr(123457))
    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert len(made) == 8 and all(m is made[0] for m in made)

def test_unused_dtype_is_freed():
    ref = weakref.ref(dtypes.int16.ptr(987653))
    gc.collect()
    assert ref() is None
    assert dtypes.int16.ptr(987653).size == 987653   # made again
