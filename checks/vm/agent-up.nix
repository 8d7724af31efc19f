# An agent comes up: the quick-start example (docs are test inputs) on a
# NixOS machine. nixos-rebuild's units are there, caged owns its bus name,
# the cage has its own loopback-only namespace, the gateway's sockets listen
# inside it, and the agent runs as a dynamic user that sees a placeholder,
# never the real key, and cannot route anywhere.
{ self }:
let
  common = import ./lib/common.nix { inherit self; };
in
{
  name = "agent-up";
  nodes.machine =
    { lib, ... }:
    {
      imports = [ common.machine ../../examples/nixos/quickstart.nix ];
      # The example's agent runs /bin/sh, which on NixOS lives in the host
      # store the cage does not see; run the same script from the tool store.
      services.nixcage.agents.demo.command = lib.mkForce [
        "/nix/tools/bin/sh"
        "-c"
        ''
          echo "agent sees API_KEY=$API_KEY"
          id -u
          curl -sS --max-time 5 --noproxy '*' http://1.1.1.1/ 2>&1 || echo "direct: no route"
          sleep infinity
        ''
      ];
      services.nixcage.agents.demo.autostart = false;
      environment.etc."nixcage/secrets/demo-api" = {
        text = "real-secret-value-0123456789";
        mode = "0400";
      };
    };

  testScript = ''
    ${common.prelude}
    machine.succeed("systemctl start nixcage-agent@demo.service")
    machine.wait_for_unit("nixcage-agent@demo.service")

    with subtest("units from the one renderer"):
        machine.succeed("systemctl cat nixcage-agent@demo.service | grep -q 'NetworkNamespacePath=/run/netns/nixcage-demo'")
        machine.succeed("systemctl is-enabled nixcage.target")
        machine.succeed("test -f /etc/nixcage/agents/demo/egress.json")

    with subtest("the cage namespace holds only lo"):
        machine.succeed("ip netns list | grep -q nixcage-demo")
        links = machine.succeed("ip -n nixcage-demo -o link show")
        assert links.count("\n") == 1 and " lo:" in links, links
        machine.succeed("test -z \"$(ip -n nixcage-demo route show)\"")

    with subtest("the gateway listens inside the cage"):
        machine.succeed("systemctl is-active cage-egress@demo.socket cage-egress-dns@demo.socket")
        machine.succeed("ip netns exec nixcage-demo ss -ltn | grep -q 127.0.0.1:3128")

    with subtest("the agent sees a placeholder and has no route"):
        machine.wait_until_succeeds("journalctl -u nixcage-agent@demo.service | grep -q 'direct: no route'")
        log = machine.succeed("journalctl -u nixcage-agent@demo.service")
        assert "agent sees API_KEY=" in log, log
        assert "real-secret-value" not in log, "the real key reached the cage"
        uid = int(log.split("agent sees API_KEY=")[1].split("\n")[1].split()[-1])
        assert uid != 0, "agent runs as root"
  '';
}
