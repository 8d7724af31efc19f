# Egress policy: an allowed host is reached through the gateway, a denied
# one and an unlisted one are refused, a direct connection has no route,
# DNS answers allowed names only, and every decision is audited.
{ self }:
let
  common = import ./lib/common.nix { inherit self; };
in
{
  name = "egress-allow-block";
  nodes.upstream = common.upstream;
  nodes.machine = {
    imports = [ common.machine common.trustUpstream ];
    services.nixcage.egressPolicies.test = {
      allow = [ "api.example.com" "*.example.org" ];
      deny = [ "evil.example.org" ];
      # The test's upstream sits on the VM LAN (192.168.1.0/24).
      unsafeAllowPrivateUpstreams = true;
    };
    services.nixcage.agents.probe = common.agent ''
      curl -sS --max-time 10 https://api.example.com/allowed > /workspace/allowed 2>&1; echo "allowed=$?" >> /workspace/rc
      curl -sS --max-time 10 https://evil.example.org/denied > /workspace/denied 2>&1; echo "denied=$?" >> /workspace/rc
      curl -sS --max-time 10 https://unlisted.example.net/ > /workspace/unlisted 2>&1; echo "unlisted=$?" >> /workspace/rc
      curl -sS --max-time 5 --noproxy '*' https://api.example.com/direct > /workspace/direct 2>&1; echo "direct=$?" >> /workspace/rc
      nslookup api.example.com 127.0.0.1 > /workspace/dns-allowed 2>&1; echo "dns-allowed=$?" >> /workspace/rc
      nslookup unlisted.example.net 127.0.0.1 > /workspace/dns-unlisted 2>&1; echo "dns-unlisted=$?" >> /workspace/rc
    '' // { egress = "test"; };
  };

  testScript = ''
    start_all()
    upstream.wait_for_open_port(443)
    ${common.prelude}
    machine.succeed("systemctl start nixcage-agent@probe.service")
    machine.wait_until_succeeds("grep -q dns-unlisted= /var/lib/nixcage/agents/probe/rc")
    rc = {k: v for k, v in (line.split("=", 1) for line in machine.succeed("cat /var/lib/nixcage/agents/probe/rc").split())}

    with subtest("allowed host reached through the gateway"):
        assert rc["allowed"] == "0", rc
        machine.succeed("grep -q 'upstream ok /allowed' /var/lib/nixcage/agents/probe/allowed")
        upstream.succeed("grep -q 'GET api.example.com /allowed' /tmp/requests.log")

    with subtest("denied and unlisted hosts refused"):
        assert rc["denied"] != "0" and rc["unlisted"] != "0", rc
        upstream.fail("grep -q /denied /tmp/requests.log")

    with subtest("no way around the gateway"):
        assert rc["direct"] != "0", rc
        upstream.fail("grep -q /direct /tmp/requests.log")

    with subtest("DNS answers allowed names only"):
        assert rc["dns-allowed"] == "0" and rc["dns-unlisted"] != "0", rc

    with subtest("every decision audited with its reason"):
        audit = "/var/log/nixcage-egress/probe/audit.jsonl"
        machine.succeed(f"jq -e 'select(.host == \"api.example.com\" and .decision == \"allowed\")' {audit}")
        machine.succeed(f"jq -e 'select(.host == \"evil.example.org\" and .decision == \"blocked\" and .reason != \"\")' {audit}")
        machine.succeed(f"jq -e 'select(.host == \"unlisted.example.net\" and .decision == \"blocked\")' {audit}")
  '';
}
