"""Keys and configuration for one sshd per test host, made fresh for each run in its temp folder.

One client key (root's identity on every host, listed in the run's ``authorized_keys``) and one host key
per host, written into a ``known_hosts`` so the client checks them strictly, as on a real cluster. The
client configuration is bind-mounted over ``/etc/ssh/ssh_config`` inside each host (netns.py), so a plain
``ssh node1 cmd`` - as the launchers run it, and as pdsh and mpirun run it - works there and nowhere else.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence

from .netns import Host

CONNECT_TIMEOUT_S = 5


def _keygen(path: str) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "zerospeed-test-cluster", "-f", path],
                   check=True, capture_output=True, timeout=30)
    with open(path + ".pub", encoding="utf-8") as f:
        return f.read().strip()


def write_keys(run_dir: str, hosts: Sequence[Host]) -> str:
    """Generate the keys; return the path of the client configuration (for ``/etc/ssh/ssh_config``)."""
    ssh_dir = os.path.join(run_dir, "ssh")
    os.makedirs(ssh_dir, mode=0o700)
    client_pub = _keygen(os.path.join(ssh_dir, "id_ed25519"))
    with open(os.path.join(ssh_dir, "authorized_keys"), "w", encoding="utf-8") as f:
        f.write(client_pub + "\n")
    known = []
    for h in hosts:
        pub = _keygen(os.path.join(ssh_dir, f"host_{h.name}"))
        known.append(f"{h.name},{h.addr} {' '.join(pub.split()[:2])}")
    with open(os.path.join(ssh_dir, "known_hosts"), "w", encoding="utf-8") as f:
        f.write("\n".join(known) + "\n")
    config = os.path.join(ssh_dir, "ssh_config")
    with open(config, "w", encoding="utf-8") as f:
        f.write(
            "Host *\n"
            f"  IdentityFile {ssh_dir}/id_ed25519\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {ssh_dir}/known_hosts\n  GlobalKnownHostsFile /dev/null\n"
            "  StrictHostKeyChecking yes\n  BatchMode yes\n  LogLevel ERROR\n"
            f"  ConnectTimeout {CONNECT_TIMEOUT_S}\n  ServerAliveInterval 2\n  ServerAliveCountMax 3\n"
        )
    return config


def sshd_config(run_dir: str, h: Host) -> str:
    ssh_dir = os.path.join(run_dir, "ssh")
    path = os.path.join(ssh_dir, f"sshd_{h.name}.conf")
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            f"ListenAddress {h.addr}\nPort 22\nHostKey {ssh_dir}/host_{h.name}\n"
            f"AuthorizedKeysFile {ssh_dir}/authorized_keys\nPidFile none\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "UsePAM no\nStrictModes no\nPrintMotd no\nPrintLastLog no\nUseDNS no\nLogLevel ERROR\n"
            "MaxStartups 100\nMaxSessions 100\n"
            # a session whose client was cut off ends after 6 s (the default keeps it for hours)
            "ClientAliveInterval 2\nClientAliveCountMax 3\n"
        )
    return path


def sshd_argv(sshd: str, config: str) -> list[str]:
    """sshd in the foreground (its children die with the host), logging to stderr."""
    return [sshd, "-D", "-e", "-f", config]
