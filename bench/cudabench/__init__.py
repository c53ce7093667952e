"""The machinery of bench/bench_cuda.py, the CUDA IPC systems side by side.

harness.py  what a system's module builds on: the Adapter interface, sizes,
            summaries, small helpers
measure.py  how every system is measured: its producer and consumer processes
runner.py   the driver: machine info, one child process per system, timeouts
report.py   Markdown tables and the plot
selftest.py the no-GPU self test (bench_cuda.py --selftest)
peers/      one module per system, registered in peers/__init__.py

bench/README.md maps each system to its file and says how to add one.
"""
