# Quarantine: an operator (wheel, via the declared account) freezes a
# misbehaving agent; its egress is cut, its workspace copied to evidence with
# a SHA-256 manifest, and systemd keeps it down, across a caged restart,
# until released. An unprivileged user cannot do it.
{ self }:
let
  common = import ./lib/common.nix { inherit self; };
in
{
  name = "quarantine";
  nodes.machine = {
    imports = [ common.machine ];
    services.nixcage.agents.suspect = common.agent ''
      echo "exfil attempt" > /workspace/loot.txt
      # Attacks on the evidence (issue 22): a 5 GiB sparse file and a name
      # that rewrites the operator's terminal line.
      /nix/tools/bin/truncate -s 5G /workspace/big
      printf x > "/workspace/$(printf 'esc\033[2K\rall fine')"
      exec /nix/tools/bin/sleep infinity
    '';
  };

  testScript = ''
    ${common.prelude}
    machine.succeed("systemctl start nixcage-agent@suspect.service")
    machine.wait_until_succeeds("test -f /var/lib/nixcage/agents/suspect/loot.txt")

    with subtest("an unprivileged user may not quarantine"):
        machine.fail("su - mallory -c 'cagectl quarantine suspect --reason test'")
        machine.succeed("systemctl is-active nixcage-agent@suspect.service")

    with subtest("an operator quarantines"):
        # Exit 0: frozen, cut off, stopped, evidence kept (issue 14).
        machine.succeed("su - alice -c 'cagectl quarantine suspect --reason exfiltration'")
        machine.wait_until_fails("systemctl is-active nixcage-agent@suspect.service")
        machine.fail("systemctl is-active cage-egress@suspect.service")
        machine.succeed("test -e /var/lib/nixcage/quarantine/suspect")

    with subtest("evidence with a manifest"):
        ev = machine.succeed("ls -d /var/lib/nixcage/evidence/suspect*").split()[0]
        machine.succeed(f"grep -rq 'exfil attempt' {ev}")
        out = machine.succeed(f"cd {ev} && sha256sum --strict -c SHA256SUMS")
        assert "\x1b" not in out and "\r" not in out, out
        machine.succeed(f"grep -q '\"workspace/big\": truncated' {ev}/omitted.txt")
        machine.succeed(f"test $(du -s --block-size=1M {ev} | cut -f1) -lt 64")

    with subtest("systemd keeps it down, even after caged restarts"):
        machine.succeed("systemctl restart nixcage-caged.service")
        machine.succeed("systemctl start nixcage-agent@suspect.service || true")
        machine.fail("systemctl is-active nixcage-agent@suspect.service")
  '';
}
