import torch

from pdserve.model.logprobs import raw_logprobs, token_logprobs


def test_logprobs_of_the_chosen_and_the_likeliest_tokens():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    raw = raw_logprobs(logits, [0, 2])
    expected = torch.log_softmax(logits[[0, 2]], -1)
    logits.mul_(0)  # the caller processes its logits in place afterwards: raw keeps its own
    out = token_logprobs(raw, [2, 1], [2, 0])
    assert out[0][0] == expected[0, 2].item()
    assert out[0][1] == [[1, expected[0, 1].item()], [2, expected[0, 2].item()]]
    assert out[1] == [expected[1, 1].item(), []]


def test_no_alternatives_asked_needs_no_topk():
    raw = raw_logprobs(torch.zeros(2, 8), [0, 1])
    assert token_logprobs(raw, [3, 4], [0, 0]) == [[-torch.log(torch.tensor(8.0)).item(), []]] * 2
