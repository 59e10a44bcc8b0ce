"""Speculative decoding: proposers guess each decoding request's next tokens, the target model
verifies them in one forward pass (EngineCore schedules the request's last token plus its
drafts), and the verification keeps the output distribution exactly the target's."""
