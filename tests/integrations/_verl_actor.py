"""verl's actor-side ``ppo_loss`` (verl/workers/utils/losses.py) on a batch laid out as verl's
engine hands it: padded prompts / responses and packed per-position log-probs."""
import torch


def run_ppo_loss(config, log_prob, old, adv, mask, weights, prompt_len=4):
    """(loss, d loss / d log_prob, metrics) of verl's ``ppo_loss(config, model_output, data)``
    with the response log-probs ``log_prob`` [B, T] placed where verl's engine puts them."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils import losses
    b, t = log_prob.shape
    x = log_prob.detach().clone().requires_grad_(True)
    # Position p of a sequence predicts token p + 1: the response log-probs sit one to the left.
    stream = [torch.cat([x.new_zeros(prompt_len - 1), x[i], x.new_zeros(1)]) for i in range(b)]
    tensors = {"prompts": torch.ones(b, prompt_len, dtype=torch.long),
               "responses": torch.ones(b, t, dtype=torch.long),
               "attention_mask": torch.ones(b, prompt_len + t, dtype=torch.long),
               "response_mask": mask.long(), "old_log_probs": old, "advantages": adv}
    if weights is not None:
        tensors["rollout_is_weights"] = weights
    data = tu.get_tensordict(tensors, {"dp_size": 1, "batch_num_tokens": None,
                                       "global_batch_size": None})
    loss, metrics = losses.ppo_loss(config, {"log_probs": torch.cat(stream)}, data)
    loss.backward()
    return loss.detach(), x.grad, metrics
