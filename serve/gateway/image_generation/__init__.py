"""`/v1/images/generations`: OpenAI's image API over a Stable Diffusion Triton entry."""
