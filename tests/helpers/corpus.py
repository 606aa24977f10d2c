"""The tiny play that the trainer tests train on (text only; `conftest.corpus` prepares it)."""

TEXT = "\n".join(
    f"ROMEO. Speak again, bright angel, for thou art as glorious to this night {i}.\n"
    f"JULIET. O Romeo, Romeo, wherefore art thou Romeo? Deny thy father {i * 7}."
    for i in range(400)
)
