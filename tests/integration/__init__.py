# vLLM's torch.compile of the model costs 35 s of every engine start on this CPU with a cold inductor cache (13 s
# warm), and no test here measures the compiled model's speed. Fixtures whose subject is not the compile serve
# eagerly; test_serve_up and `make demo` start vLLM as a user's deployment does, compiled.
VLLM_EAGER = ["--enforce-eager"]
