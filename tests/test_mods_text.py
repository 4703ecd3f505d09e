"""`varlen.mods.text`: a traced graph as its canonical text and back, as the PyTorch op and the
JAX trace key carry it."""
import numpy as np
import pytest

import varlen
from varlen import ScoreMod
from varlen.mods.text import graph_from_text, graph_text

from mods_cases import mask_cases, score_cases


def _odd(score, b, h, q_idx, k_idx, table):
    far = varlen.where(abs(q_idx - k_idx) > 3, -np.inf, 1e-05 * score)
    return far + table[h] * (q_idx % 3 == 0) - varlen.exp(-score) + varlen.maximum(b, 2) // 2


@pytest.mark.parametrize("mod", [m for _, m in mask_cases([3, 8]) + score_cases(2)] +
                         [ScoreMod(_odd, np.ones(2, np.float32))],
                         ids=[i for i, _ in mask_cases([3, 8]) + score_cases(2)] + ["odd"])
def test_round_trip_keeps_the_digest(mod):
    text = graph_text(mod.graph)
    graph = graph_from_text(text)
    assert graph.digest == mod.digest and graph.aux == mod.graph.aux
    assert graph_text(graph) == text


@pytest.mark.parametrize("text", ["score_mod|score|()|add(score(),", "nonsense",
                                  "score_mod|score|()|frobnicate(score())"])
def test_other_text_is_refused(text):
    with pytest.raises(ValueError, match="not the text of a mask_mod or score_mod graph"):
        graph_from_text(text)
