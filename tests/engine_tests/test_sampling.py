import pytest
import torch

from engine.sampling import SamplingParams, apply_repetition_penalty, choose, filter_min_p, filter_top_k, filter_top_p


def test_greedy_lowest_index_wins_a_tie():
    # Paris, Lyon after quantization: [0.5, 0.5] -> Paris (index 0)
    assert choose(torch.tensor([0.5, 0.5]), SamplingParams()) == 0
    assert choose(torch.tensor([0.6, 0.7]), SamplingParams()) == 1
    assert choose(torch.tensor([0.1, 0.9, 0.9, 0.2]), SamplingParams()) == 1


def test_seed_fixes_the_output():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=3)

    def draw():
        g = torch.Generator().manual_seed(3)
        return [choose(logits, p, g) for _ in range(20)]

    a, b = draw(), draw()
    assert a == b and len(set(a)) > 1


def test_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(filter_top_k(logits, 2)).tolist() == [False, False, True, True]
    probs = logits.softmax(-1)  # 0.644, 0.237, 0.087, 0.032
    assert torch.isinf(filter_top_p(logits, 0.5)).tolist() == [False, True, True, True]
    assert torch.isinf(filter_top_p(logits, 0.7)).tolist() == [False, False, True, True]
    assert torch.isinf(filter_min_p(logits, 0.2)).tolist() == [False, False, True, True]
    assert probs[2] < 0.2 * probs[0] < probs[1]


def test_sampling_respects_top_k():
    logits = torch.tensor([1.0, 1.0, 5.0, 1.0])
    g = torch.Generator().manual_seed(0)
    draws = {choose(logits, SamplingParams(temperature=5.0, top_k=1), g) for _ in range(50)}
    assert draws == {2}


def test_repetition_penalty():
    out = apply_repetition_penalty(torch.tensor([2.0, -2.0, 1.0]), torch.tensor([0, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)


def test_temperatures_and_top_p_that_underflow_still_draw_the_top_token():
    """A temperature of 1e-40 (the logits over it overflow) and a top-p of 1e-300 (0 in float32) drew from
    NaN probabilities; both are sampling that keeps only the most likely token, which they now draw."""
    from engine.sampling import SamplingParams, draw

    logits = torch.tensor([1.0, 3.0, 2.5, -1.0])
    g = torch.Generator().manual_seed(0)
    for params in (SamplingParams(temperature=1e-40), SamplingParams(temperature=1.0, top_p=1e-300),
                   SamplingParams(temperature=1e-40, top_p=1e-300, min_p=1.0)):  # fmt: skip
        token, drawn = draw(logits, params, g)
        assert token == 1 and not torch.isnan(drawn.softmax(-1)).any()
