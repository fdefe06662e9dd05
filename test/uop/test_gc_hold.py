"""toposort_memo() turns the cyclic garbage collector off while the main thread is inside one, and back to how it
was after."""
import gc
import threading
from fusegrad.uop.ops import toposort_memo

def test_off_inside_and_back_on_after():
    assert gc.isenabled()
    with toposort_memo():
        assert not gc.isenabled()
        with toposort_memo(): assert not gc.isenabled()
        assert not gc.isenabled()   # still inside the outer one
    assert gc.isenabled()

def test_left_off_when_it_was_off():
    gc.disable()
    try:
        with toposort_memo(): assert not gc.isenabled()
        assert not gc.isenabled()
    finally: gc.enable()

def test_back_on_after_an_exception():
    try:
        with toposort_memo(): raise ValueError("inside")
    except ValueError: pass
    assert gc.isenabled()

def test_other_threads_leave_it_alone():
    seen = []
    def worker():
        with toposort_memo(): seen.append(gc.isenabled())
    t = threading.Thread(target=worker)
    t.start()
    t.join(10)
    assert seen == [True] and gc.isenabled()

def test_cycles_made_inside_are_collected_after():
    class Node: pass
    with toposort_memo():
        a, b = Node(), Node()
        a.other, b.other = b, a
        probe = [a]
        del a, b
    import weakref
    ref = weakref.ref(probe.pop())
    assert ref() is not None
    gc.collect()
    assert ref() is None
