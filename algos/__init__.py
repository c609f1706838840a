"""rose-jax algorithms: PPO and SAC as pure functions over explicit pytree state."""
