"""jaxvla: RL fine-tuning of Vision-Language-Action policies in JAX."""
