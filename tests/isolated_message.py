"""A rank of an emulated 2-node job (commbench emulate): rank 1 sends SIZE
bytes to rank 0 over TCP after PAUSE_S of idle, rank 0 answers one byte; rank
1 prints the median round trip of REPS, in seconds. Run with plain sockets so
that nothing but the emulated link stands between the two."""
import os
import socket
import statistics
import sys
import time

SIZE, REPS, PAUSE_S = int(sys.argv[1]), 30, 0.02


def main():
    rank, addr, port = int(os.environ["RANK"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 7
    if rank == 0:
        with socket.create_server((addr, port)) as srv:
            conn, _ = srv.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for _ in range(REPS):
                    got = 0
                    while got < SIZE:
                        got += len(conn.recv(SIZE - got))
                    conn.sendall(b"k")
        return
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((addr, port))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload, rtts = b"x" * SIZE, []
        for _ in range(REPS):
            time.sleep(PAUSE_S)
            t0 = time.perf_counter()
            conn.sendall(payload)
            conn.recv(1)
            rtts.append(time.perf_counter() - t0)
    print(f"median_rtt_s {statistics.median(rtts):.6f}", flush=True)


if __name__ == "__main__":
    main()
