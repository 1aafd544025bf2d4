python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
mkdir -p /tmp/full && python -c "
import json; c = json.load(open('hf_models/GPT-OSS-120B/config.json')); c['layer_types'][0] = 'full_attention'
json.dump(c, open('/tmp/full/config.json', 'w'), indent=1)"
P="python -m disagmoe_ds.planner.cli profile --parts disagmoe_ds.models.one_layer:compiled_disagmoe_parts --seq-len 2048,4096,8192,16384 --repeats 5"
timeout 260 $P --model hf_models/GPT-OSS-120B --out $OUT/gptoss-sliding-flex-compiled.json 2>&1 | grep -v Warning | tail -8
timeout 260 $P --model /tmp/full --out $OUT/gptoss-full-flex-compiled.json 2>&1 | grep -v Warning | tail -8
