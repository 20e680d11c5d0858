"""kv.layout.split_layers: how the pools cut their layers into layer-streamed push's groups."""
import pytest

from pushkv.kv.layout import split_layers


@pytest.mark.parametrize("layers, parts, sizes", [
    (36, 10, (2, 4, 4, 4, 4, 4, 4, 4, 4, 2)),  # qwen3-8b at the default: half-size ends
    (64, 10, (4, 7, 7, 7, 7, 7, 7, 7, 7, 4)),
    (48, 10, (3, 6, 6, 5, 5, 5, 5, 5, 5, 3)),  # the runs between: the earlier ones a layer longer
    (4, 3, (1, 2, 1)),
    (8, 10, (1,) * 8),  # never more groups than layers
    (36, 2, (18, 18)),  # two groups: no middle, equal halves
    (7, 2, (4, 3)),
    (5, 1, (5,)),
    (1, 5, (1,)),
    (36, 35, (1, 2) + (1,) * 33),  # the ends never take what the middle needs
])
def test_the_cut(layers, parts, sizes):
    groups = split_layers(layers, parts)
    assert tuple(len(g) for g in groups) == sizes
    assert [layer for g in groups for layer in g] == list(range(layers))  # consecutive, each layer once


def test_every_cut_is_whole_and_its_ends_are_the_shortest():
    for layers in range(1, 129):
        for parts in range(1, 33):
            groups = split_layers(layers, parts)
            sizes = [len(g) for g in groups]
            assert len(sizes) == min(parts, layers) and min(sizes) >= 1, (layers, parts)
            assert [layer for g in groups for layer in g] == list(range(layers)), (layers, parts)
            if len(sizes) >= 3:
                assert max(sizes[0], sizes[-1]) <= min(sizes[1:-1]), (layers, parts, sizes)
