"""M-RoPE prompt positions (multimodal/mrope.py) against transformers' Qwen2.5-VL
``get_rope_index`` on the same token layout: images of different sizes, adjacent text, a prompt
that ends with an image; and the delta that decode positions add (last position + 1 - length)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from jaxlm.multimodal.mrope import mrope_input_positions

IMAGE = 9


def _hf_rope_index(ids: list[int], grids: list[tuple[int, int, int]], merge: int):
    import torch
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    config = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge, tokens_per_second=2))
    model = SimpleNamespace(config=config)
    model.get_vision_position_ids = lambda *a, **k: Qwen2_5_VLModel.get_vision_position_ids(model, *a, **k)
    x = torch.tensor([ids])
    pos, delta = Qwen2_5_VLModel.get_rope_index(model, x, (x == IMAGE).int(), image_grid_thw=torch.tensor(grids))
    return pos[:, 0].numpy(), int(delta[0, 0])


def _layout(pieces: list) -> tuple[list[int], list]:
    """pieces: a text length (int) or a patch grid (tuple): the token ids and each image's range."""
    ids, images = [], []
    for p in pieces:
        if isinstance(p, int):
            ids += [1] * p
        else:
            n = p[0] * (p[1] // 2) * (p[2] // 2)
            images.append((len(ids), n, p))
            ids += [IMAGE] * n
    return ids, images


@pytest.mark.parametrize("pieces", [
    [3, (1, 4, 6), 2],
    [1, (1, 8, 4), 4, (1, 2, 2), 1, (1, 6, 10), 5],
    [2, (1, 4, 4)],
    [7],
])
def test_positions_and_delta_match_transformers(pieces):
    ids, images = _layout(pieces)
    ours, delta = mrope_input_positions(len(ids), images, 2)
    if images:
        ref, ref_delta = _hf_rope_index(ids, [g for _, _, g in images], 2)
        np.testing.assert_array_equal(ours, ref)
        assert delta == ref_delta
    else:  # transformers' plain positions: the index, delta 0
        np.testing.assert_array_equal(ours, np.broadcast_to(np.arange(len(ids)), (3, len(ids))))
        assert delta == 0


def test_a_run_that_does_not_match_its_grid_is_refused():
    with pytest.raises(ValueError, match="do not match its 1x4x4 patch grid"):
        mrope_input_positions(10, [(2, 5, (1, 4, 4))], 2)
