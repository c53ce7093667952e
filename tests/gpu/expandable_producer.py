
import multiprocessing, sys
import torch, usmipc

def consumer(conn):
    try:
        consume(conn)
    except BaseException:
        import traceback
        conn.send(("error", traceback.format_exc()))
        raise

def consume(conn):
    import faulthandler, torch, usmipc
    faulthandler.dump_traceback_later(30, exit=True)
    data = conn.recv()
    tree = usmipc.open_shared(data, to="torch")
    sums = {k: v.float().sum().item() for k, v in tree.items()}
    tree["big"][:10].fill_(7)
    torch.cuda.synchronize()
    conn.send(("ok", sums, usmipc.stats()))
    conn.recv()

if __name__ == "__main__":
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(1)
    big = torch.randn(25 << 20, device=dev, generator=g)    # 100 MiB
    tree = {"small": torch.randn(1000, device=dev, generator=g),
            "big": big,
            "view": big[3:(8 << 20)],                        # 32 MiB
            "half": torch.randn(4096, 512, device=dev,
                                dtype=torch.float16, generator=g)}
    torch.cuda.synchronize()
    # the producer's values before the consumer writes into "big"
    wants = {k: v.float().sum().item() for k, v in tree.items()}
    try:
        bundle = usmipc.share(tree)
    except usmipc.Error as e:
        print("SHARE-REFUSED", e.name, e)
        sys.exit(3)
    print("bundle", bundle.arrays, "arrays in", bundle.allocations,
          "allocations;", usmipc.stats())
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=consumer, args=(child,), daemon=True)
    p.start()
    parent.send(bundle.to_bytes())
    assert parent.poll(60), "consumer silent, exit code %s" % p.exitcode
    reply = parent.recv()
    assert reply[0] == "ok", reply[1]
    _, sums, stats = reply
    print("consumer stats", stats)
    for k, v in tree.items():
        want = wants[k]
        assert abs(sums[k] - want) <= 1e-3 * max(1.0, abs(want)), (k, sums[k], want)
    torch.cuda.synchronize()
    assert big[:10].eq(7).all().item(), "write did not come back"
    parent.send("bye")
    p.join(60)
    assert p.exitcode == 0
    print("RESULT ok")
