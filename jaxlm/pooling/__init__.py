"""The pooling runner's own parts: which runner and pooler a model gets (``resolve``, no jax),
the pooler inside the compiled step (``pooler``) and the per-request finishing on the host
(``postprocess``: Matryoshka truncation, normalization, the classifier's activation)."""
