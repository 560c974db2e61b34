#!/usr/bin/env python3
"""Upload speed of `dptrain provision` over a link with latency, against OpenSSH's scp.

Starts a private sshd on 127.0.0.1 and, for each round-trip time asked for, a TCP proxy in front
of it that holds every chunk for half the RTT in each direction (pure latency, no bandwidth
limit: what a WAN link between two data centres adds). Through that proxy it times:

  provision   dptrain provision into a fresh work directory (uploads the binary, FILE and checks)
  provision0  the same again: every file is already there, nothing is uploaded
  scp         OpenSSH scp of the same files (SFTP protocol, pipelined requests)
  scp-O       scp -O, the legacy protocol (one stream over an exec channel)
  sftp-R1     sftp with one 64 KiB write request in flight at a time: how a synchronous SFTP
              client (libssh 0.10's sftp_write) uploads, one round trip per 64 KiB

dptrain's upload time is what provision's JSON reports for the upload (uploads[].seconds); scp's
is scp - `ssh host true` (the connection taken away), and sftp's the same; figures are quoted as ratios against scp measured in the same
run, since the machine is shared.

  python3 bench/provision_wan.py --binary build/dptrain --rtt-ms 0,10,40 [--json]

Needs /usr/sbin/sshd, ssh-keygen and scp (Debian's openssh-server and openssh-client).
"""

import argparse
import asyncio
import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the latency proxy (runs in a thread with its own event loop) ----


class LatencyProxy:
    def __init__(self, target_port, one_way_s):
        self.target_port = target_port
        self.delay = one_way_s
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait()

    def _run(self, ready):
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._client, "127.0.0.1", self.port)
        )
        ready.set()
        self.loop.run_forever()

    async def _shutdown(self):
        self.server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _pipe(self, reader, writer):
        loop = asyncio.get_running_loop()
        pending = collections.deque()  # (due, bytes); b"" is the end of the stream
        arrived = asyncio.Event()

        async def deliver():
            while True:
                await arrived.wait()
                arrived.clear()
                while pending:
                    wait = pending[0][0] - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    # Everything due by now goes in one write: one timer per chunk would cap
                    # the rate at the timer's resolution, not the link's.
                    now, out, end = loop.time(), [], False
                    while pending and pending[0][0] <= now:
                        data = pending.popleft()[1]
                        if not data:
                            end = True
                            break
                        out.append(data)
                    if out:
                        writer.write(b"".join(out))
                        await writer.drain()
                    if end:
                        try:
                            writer.write_eof()
                        except OSError:
                            pass
                        return

        sender = asyncio.create_task(deliver())
        try:
            while True:
                data = await reader.read(1 << 20)
                pending.append((loop.time() + self.delay, data))
                arrived.set()
                if not data:
                    break
            await sender
        except (ConnectionError, OSError):
            sender.cancel()

    async def _client(self, reader, writer):
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        up_writer.close()
        writer.close()

    def stop(self):
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


# ---- a private sshd ----


class Sshd:
    def __init__(self, root):
        self.root = root
        self.port = free_port()
        self.host_key = os.path.join(root, "host_ed25519")
        self.client_key = os.path.join(root, "client_ed25519")
        for key in (self.host_key, self.client_key):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True
            )
        auth = os.path.join(root, "authorized_keys")
        shutil.copy(self.client_key + ".pub", auth)
        config = os.path.join(root, "sshd_config")
        with open(config, "w") as f:
            f.write(
                f"ListenAddress 127.0.0.1:{self.port}\nHostKey {self.host_key}\n"
                f"PidFile {root}/sshd.pid\nAuthorizedKeysFile {auth}\n"
                "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                "Subsystem sftp internal-sftp\nMaxStartups 100\nPrintMotd no\n"
            )
        os.makedirs("/run/sshd", exist_ok=True)
        self.proc = subprocess.Popen(
            ["/usr/sbin/sshd", "-D", "-e", "-f", config],
            stderr=open(os.path.join(root, "sshd.log"), "w"),
        )
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise SystemExit("sshd did not start: see " + os.path.join(root, "sshd.log"))

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=10)


def timed(argv, **kwargs):
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(
            f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr.decode()[-2000:]}"
        )
    return elapsed, done


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--binary", default="build/dptrain")
    parser.add_argument("--rtt-ms", default="0,10,40", help="round-trip times, comma-separated")
    parser.add_argument("--repeat", type=int, default=2, help="runs per figure; the best is kept")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    binary = os.path.abspath(args.binary)
    user = os.environ.get("USER") or subprocess.run(
        ["id", "-un"], stdout=subprocess.PIPE, text=True
    ).stdout.strip()
    size = os.path.getsize(binary)
    rows = []
    with tempfile.TemporaryDirectory(prefix="dptrain-wan-") as root:
        sshd = Sshd(root)
        try:
            for rtt_ms in [float(x) for x in args.rtt_ms.split(",")]:
                proxy = LatencyProxy(sshd.port, rtt_ms / 2000.0)
                try:
                    rows.append(measure(args, root, binary, user, sshd, proxy, rtt_ms, size))
                finally:
                    proxy.stop()
                if not args.json:
                    print_row(rows[-1], size)
        finally:
            sshd.stop()
    if args.json:
        print(json.dumps({"bytes": size, "rows": rows}, indent=1))


def measure(args, root, binary, user, sshd, proxy, rtt_ms, size):
    hostfile = os.path.join(root, "hosts.txt")
    with open(hostfile, "w") as f:
        f.write(f"127.0.0.1 port={proxy.port} user={user} key={sshd.client_key}\n")
    known = os.path.join(root, f"known_hosts.{proxy.port}")
    best = {}

    def keep(name, seconds):
        best[name] = min(best.get(name, seconds), seconds)

    ssh_opts = [
        "-o", "StrictHostKeyChecking=no", "-o", f"UserKnownHostsFile={known}",
        "-o", "LogLevel=ERROR", "-i", sshd.client_key, "-P", str(proxy.port),
    ]
    for attempt in range(args.repeat):
        workdir = os.path.join(root, f"work-{proxy.port}-{attempt}")
        provision = [
            binary, "provision", "--hosts", hostfile, "--workdir", workdir,
            "--known-hosts", known, "--accept-new-host-keys", "--json",
        ]
        seconds, done = timed(provision)
        report = json.loads(done.stdout)
        uploads = report["hosts"][0]["uploads"]
        if [u["status"] for u in uploads] != ["uploaded"]:
            raise SystemExit(f"expected one upload, got {uploads}")
        keep("provision", seconds)
        keep("upload", uploads[0]["seconds"])
        seconds, _ = timed(provision)
        keep("provision0", seconds)
        ssh = ["ssh", *[o if o != "-P" else "-p" for o in ssh_opts], f"{user}@127.0.0.1", "true"]
        seconds, _ = timed(ssh)
        keep("ssh", seconds)
        for name, extra in (("scp", []), ("scp-O", ["-O"])):
            target = f"{user}@127.0.0.1:{workdir}/scp-copy"
            seconds, _ = timed(["scp", "-q", *extra, *ssh_opts, binary, target])
            keep(name, seconds)
        batch = os.path.join(root, "sftp-batch")
        with open(batch, "w") as f:
            f.write(f"put {binary} {workdir}/sftp-copy\n")
        sftp = ["sftp", "-q", "-R", "1", "-B", "65536", "-b", batch,
                *[o for o in ssh_opts], f"{user}@127.0.0.1"]
        seconds, _ = timed(sftp)
        keep("sftp-R1", seconds)
    upload = best["upload"]
    scp = max(best["scp"] - best["ssh"], 1e-9)
    return {
        "rtt_ms": rtt_ms,
        "provision_s": best["provision"],
        "provision_nothing_s": best["provision0"],
        "upload_s": upload,
        "upload_mib_per_s": size / upload / 2**20,
        "scp_s": best["scp"],
        "scp_legacy_s": best["scp-O"],
        "sftp_one_request_s": best["sftp-R1"],
        "sftp_one_request_mib_per_s": size / max(best["sftp-R1"] - best["ssh"], 1e-9) / 2**20,
        "ssh_connect_s": best["ssh"],
        "scp_upload_s": scp,
        "scp_upload_mib_per_s": size / scp / 2**20,
        "upload_vs_scp": scp / upload,
    }


def print_row(row, size):
    print(
        f"rtt {row['rtt_ms']:5.1f} ms  {size / 2**20:.1f} MiB: provision {row['provision_s']:.2f} s"
        f" (nothing to upload {row['provision_nothing_s']:.2f} s, upload"
        f" {row['upload_mib_per_s']:.1f} MiB/s); scp {row['scp_s']:.2f} s (ssh true"
        f" {row['ssh_connect_s']:.2f} s, upload {row['scp_upload_mib_per_s']:.1f} MiB/s),"
        f" scp -O {row['scp_legacy_s']:.2f} s, sftp -R 1 {row['sftp_one_request_s']:.2f} s"
        f" ({row['sftp_one_request_mib_per_s']:.1f} MiB/s); upload speed dptrain/scp"
        f" {row['upload_vs_scp']:.2f}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
