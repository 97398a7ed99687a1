"""Image inputs: what a request carries to the engine core (inputs.py, no jax) and the front
end's preprocessing with the checkpoint's own HF processor (processing.py)."""
