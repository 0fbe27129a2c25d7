"""The peer of `tl bench model`: llama.cpp, as the prebuilt PyPI wheel `xllamacpp` runs it.

Two jobs, chosen by the first argument:

  convert SRC DST TYPE   writes SRC's weights as TYPE (F32, BF16, F16 or Q8_0) into the GGUF
                         file DST, every key of SRC's metadata kept, so both engines load the
                         same values. The norms stay F32, as llama.cpp's own converter leaves them.
  bench GGUF THREADS PROMPT STEPS
                         loads GGUF in llama.cpp on THREADS threads and prints one JSON line:
                         prefill tokens/s of a PROMPT-token prompt and decode tokens/s of STEPS
                         greedy tokens, as llama.cpp's own timings report them.

Only the packages installed beside this file are imported (the bench puts them on PYTHONPATH).
"""

import json
import sys


def convert(src, dst, kind):
    import numpy as np
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    target = getattr(gguf.GGMLQuantizationType, kind)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = [int(d) for d in reversed(t.shape)]
        values = values.reshape(shape)
        qtype = target
        if values.ndim == 1 or values.shape[-1] % 32 != 0:
            qtype = gguf.GGMLQuantizationType.F32
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(t.name, values)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(t.name, values.astype(np.float16))
        else:
            data = gguf.quants.quantize(values, qtype)
            writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def bench(path, threads, prompt, steps):
    import xllamacpp as xlc

    params = xlc.CommonParams()
    params.model.path = path
    params.n_ctx = prompt + steps + 64
    params.n_batch = prompt
    params.n_ubatch = prompt
    params.n_parallel = 1
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    params.warmup = True
    server = xlc.Server(params)
    best = {"prefill_tokens_per_s": 0.0, "decode_tokens_per_s": 0.0}
    for run in range(3):
        # A prompt of PROMPT distinct tokens (the run number first, so no cache is reused).
        tokens = [(run * 7919 + t * 13 + 5) % 40000 + 100 for t in range(prompt)]
        r = server.handle_completions(
            {"prompt": tokens, "max_tokens": 1, "temperature": 0.0, "cache_prompt": False}
        )
        t = r["timings"]
        best["prefill_tokens_per_s"] = max(best["prefill_tokens_per_s"], t["prompt_per_second"])
        r = server.handle_completions(
            {
                "prompt": [run + 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
                "max_tokens": steps,
                "temperature": 0.0,
                "ignore_eos": True,
                "cache_prompt": False,
            }
        )
        t = r["timings"]
        best["decode_tokens_per_s"] = max(best["decode_tokens_per_s"], t["predicted_per_second"])
        best["decode_tokens"] = t["predicted_n"]
        best["prefill_tokens"] = prompt
    print(json.dumps(best))


if __name__ == "__main__":
    if sys.argv[1] == "convert":
        convert(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "bench":
        bench(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        sys.exit("usage: llamacpp.py convert SRC DST TYPE | bench GGUF THREADS PROMPT STEPS")
