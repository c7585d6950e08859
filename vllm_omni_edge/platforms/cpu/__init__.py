"""vLLM-Omni's CPU platform: entry-point probe, platform class, stage workers, diffusion attention."""
