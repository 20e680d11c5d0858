"""The fault tests' KV damage as a filter on P's effects (``pushkv/writer/kv_damage.py``):
only a last WRITE is damaged, each fired point once, and an unarmed filter changes nothing.
(The flipped bytes themselves, P's and D's: tests/e2e/test_kv_verify.py.)"""
import dataclasses
from types import SimpleNamespace

import pytest

from pushkv import messages as m
from pushkv.protocol import actions as A
from pushkv.writer import sides as S
from pushkv.writer.kv_damage import KVDamage

REG = m.Register("t", 0, "d", 0, 1, (5, 6, 7), 48)
LAST = A.PostWrite("t", 0, (1, 2, 3), 48, 9, (REG,))
PART = dataclasses.replace(LAST, num_tokens=16, last=False)
LAYERED = dataclasses.replace(LAST, spans=((0, 16, 48), (1, 32, 48)))


class Fired:
    def __init__(self, *armed: str):
        self.armed = set(armed)

    def fire(self, name: str) -> bool:
        if name in self.armed:
            self.armed.remove(name)
            return True
        return False


@pytest.mark.parametrize("armed,post,want", [
    ((), LAST, S.Post(LAST)),
    (("kv_truncate", "kv_swap_dest"), PART, S.Post(PART)),  # parts are never damaged
    (("kv_swap_dest",), LAST, S.Post(LAST, swap_dest=True)),
    (("kv_truncate",), LAST, S.Post(dataclasses.replace(LAST, spans=((-1, 0, 32),)))),
    (("kv_truncate",), LAYERED, S.Post(dataclasses.replace(LAST, spans=((0, 16, 48), (1, 32, 33))))),
])
def test_damage_filters_a_last_write(armed, post, want):
    faults = Fired(*armed)
    kv = KVDamage(faults, SimpleNamespace(layout=SimpleNamespace(block_size=16), pool=None))
    tell = S.Tell(("d", 0), m.WriteFailed("t", 0, 0, "x"))
    assert kv.effects([tell, S.Post(post)]) == [tell, want]
    assert kv.effects([S.Post(post)]) == [S.Post(post)]  # each point fires once (a part: never)
