"""One 1024x1024 photo's TTFT on an InternVL3.5 checkpoint under the default schedule, `--step-time-target off` and
`--scheduling fcfs` (the offline LLM, the family's default budget, caches off, new photos each time; medians of 5):
where the default's time against transformers goes (bench_internvl_ttft.py).

    python benchmarks/bench_internvl_schedules.py MODEL_DIR
"""
import sys, time, statistics, gc
sys.path.insert(0,'benchmarks')
from bench_internvl_ttft import photo, messages
from firsttoken import LLM
res={}
for name, opts in (("default",{}),("step-time-target off",{"step_time_target":"off"}),("fcfs",{"scheduling":"fcfs"})):
    llm = LLM(sys.argv[1], dtype="float32", image_max_tokens=3328, no_prefix_cache=True, no_encoder_cache=True, **opts)
    llm.chat(messages([photo(1024,1024,999)]), {"max_tokens":1})
    walls=[]; steps=[]; enc=[]; fwd=[]
    for r in range(5):
        req=messages([photo(1024,1024,7000+r)])
        t=time.perf_counter(); out=llm.chat(req, {"max_tokens":1,"temperature":0.0}); walls.append(time.perf_counter()-t)
        steps.append(out.timings.get('steps_to_first_token')); enc.append(out.timings.get('encoder_compute_s')); fwd.append(out.timings.get('forward_s'))
    res[name]=(statistics.median(walls), steps, statistics.median(enc), statistics.median(fwd))
    print(f"{name:22s} TTFT {statistics.median(walls):.2f} s  steps {steps}  encoder {statistics.median(enc):.2f} s  forwards {statistics.median(fwd):.2f} s", flush=True)
    del llm; gc.collect()
