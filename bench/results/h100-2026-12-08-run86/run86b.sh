#!/usr/bin/env bash
# Run 86's two follow-up calls on the same warm H100 (stop 43): the H100
# CPU's share()/dumps on host memory, then torch_mp_bench alternated H A H A
# (H = fcff0fd in .carry/ab/H, A = the tree of 52a9766), because run 86's
# single tmb of each disagreed with the VM's order for the warm state dict.
# Call 1 (its tmb lines printed nothing: --mode usmipc prints no table):
t0=$SECONDS; for v in H A H A; do d=.; [ $v = H ] && d=.carry/ab/H; (cd $d && python3 -m pip install -q --no-build-isolation --no-index --no-deps . >/dev/null 2>&1) || echo PIPFAIL; timeout 50 python3 tests/gpu/torch_mp_bench.py --mode usmipc --rounds 15 2>&1 | grep -E "^state_dict_warm|^tensor_repeated" | sed "s/^/$v /"; timeout 30 python3 bench/bench_torch_reads.py --label $v --reps 15 2>&1 | tail -1; echo "== $v at $((SECONDS-t0)) s"; [ $((SECONDS-t0)) -gt 250 ] && break; done
# Its output:
#   H: us a tensor: attrs 0.566, share 0.846 (above attrs 0.280); dumps of 338 tensors 1.459 ms (4.32 us a tensor)
#   A: us a tensor: attrs 0.429, share 0.477 (above attrs 0.048); dumps of 338 tensors 1.232 ms (3.64 us a tensor)
#   H: us a tensor: attrs 0.603, share 0.885 (above attrs 0.283); dumps of 338 tensors 2.158 ms (6.38 us a tensor)
#   A: us a tensor: attrs 0.690, share 0.783 (above attrs 0.093); dumps of 338 tensors 1.391 ms (4.12 us a tensor)
# Call 2 (logs tmb2_<v><seconds>.log beside this file):
t0=$SECONDS; mkdir -p $OUT; for v in H A H A; do d=.; [ $v = H ] && d=.carry/ab/H; (cd $d && python3 -m pip install -q --no-build-isolation --no-index --no-deps . >/dev/null 2>&1) || echo PIPFAIL; timeout 65 python3 tests/gpu/torch_mp_bench.py --rounds 15 > $OUT/tmb2_$v$SECONDS.log 2>&1; grep -E "^state_dict_warm|^tensor_repeated" $OUT/tmb2_$v*.log | tail -10 | sed "s/^/$v /"; echo "== $v at $((SECONDS-t0)) s"; [ $((SECONDS-t0)) -gt 230 ] && break; done
