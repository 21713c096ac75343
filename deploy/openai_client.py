"""Talk to `python -m peagle_jax.serve` with the official openai client.

    python -m peagle_jax.serve            # in another terminal (127.0.0.1:8000)
    python deploy/openai_client.py
"""

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")  # any key unless --api-key

reply = client.chat.completions.create(
    model="smollm2-135m-instruct",
    messages=[{"role": "user", "content": "Write a Python function that reverses a string."}],
    max_tokens=128,
    temperature=0,
)
print(reply.choices[0].message.content)
print(reply.usage)

stream = client.completions.create(
    model="smollm2-135m-instruct", prompt="The three primary colors are", max_tokens=32, temperature=0.7,
    top_p=0.95, stop=["\n\n"], stream=True,
)
for chunk in stream:
    print(chunk.choices[0].text, end="", flush=True)
print()
