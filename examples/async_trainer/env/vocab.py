"""Token ids of the one vocabulary every task shares (the bottom of the example: imports
nothing of it).

The 8 role / task tokens, the 15 ToRA tokens (task token, code fragments, an error marker
and the decimal digits ``"0".."9"``), then the ``vocab_digits`` digits of the reverse and
tool tasks. Every id but the last group is fixed, so a prompt's task is known from its ids
alone.
"""
SYSTEM, USER, ASSISTANT, OBSERVATION, EOS, TOOL_CALL, TASK_REVERSE, TASK_TOOL = range(8)
# ToRA tokens (rendered as text by tora_task.TOKENIZER): the task, the code block's pieces
# '```python\nprint(', '*', ')\n```', an error marker, and the decimal digits "0".."9".
TASK_TORA, PY_OPEN, MUL, PY_CLOSE, ERR = range(8, 13)
DEC0 = 13
N_SPECIAL = DEC0 + 10            # the reverse / tool digits start here
PAD = EOS
ROLE_NAMES = {SYSTEM: "system", USER: "user", ASSISTANT: "assistant", OBSERVATION: "observation"}


def vocab_size(cfg) -> int:
    return N_SPECIAL + cfg.vocab_digits
