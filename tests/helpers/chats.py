"""Chat prompts the bundled-model tests share (tests/worker/test_smollm2.py, the MLX backend's)."""

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse coding assistant."},
        {"role": "user", "content": "Write a Python function that reverses a string."},
    ],
    [{"role": "user", "content": "Name three colours of the rainbow."}],
]
