# cagectl run (docs/run.md), the NixOS twin of checks/system TestRunOnSystemd:
# an operator runs a script in a throw-away cage from its own directory; the
# allowed request is reached, the denied one refused and audited, the exit
# status is cagectl's, the file written in /workspace is the caller's, a
# viewer is refused with exit 3, and nothing but the audit is left.
{ self }:
let
  common = import ./lib/common.nix { inherit self; };
in
{
  name = "run";
  nodes.upstream = common.upstream;
  nodes.machine = {
    imports = [ common.machine common.trustUpstream ];
    services.nixcage.egressPolicies.test = {
      allow = [ "api.example.com" ];
      # The test's upstream sits on the VM LAN (192.168.1.0/24).
      unsafeAllowPrivateUpstreams = true;
    };
    services.nixcage.accounts.viewers = { user = "mallory"; role = "viewer"; };
  };

  testScript = ''
    start_all()
    upstream.wait_for_open_port(443)
    ${common.prelude}
    machine.succeed("install -d -o alice -g users /home/alice/project")
    job = "\n".join([
        "echo \"allowed: $(curl -sS -o /dev/null -w '%{http_code}' https://api.example.com/allowed)\"",
        "echo \"refused: $(curl -sS -o /dev/null -w '%{http_code}' https://evil.example.org/denied 2>&1)\"",
        "echo written > /workspace/out.txt",
        "exit 7",
    ])
    machine.succeed(f"cat > /home/alice/project/job.sh <<'EOS'\n{job}\nEOS")

    with subtest("the command's exit status is cagectl's, the summary names the block"):
        rc, out = machine.execute("su - alice -c 'cd /home/alice/project && cagectl run --policy test -- /nix/tools/bin/sh job.sh' 2>&1")
        assert rc == 7, (rc, out)
        assert "allowed: 200" in out, out
        assert "blocked: evil.example.org" in out, out
        upstream.succeed("grep -q 'GET api.example.com /allowed' /tmp/requests.log")
        upstream.fail("grep -q /denied /tmp/requests.log")

    with subtest("the workspace is the caller's directory, written as the caller"):
        machine.succeed("test \"$(stat -c %U /home/alice/project/out.txt)\" = alice")

    with subtest("a viewer is refused with the role it needs"):
        rc, out = machine.execute("su - mallory -c 'cagectl run --no-workspace -- /nix/tools/bin/true' 2>&1")
        assert rc == 3 and 'role "operator"' in out, (rc, out)

    with subtest("nothing but the audit is left"):
        machine.succeed("test -z \"$(ls /run/systemd/system | grep '@run-')\"")
        machine.succeed("test -z \"$(ls /run/nixcage/runs)\"")
        machine.succeed("test -z \"$(ip netns list | grep nixcage-run-)\"")
        machine.succeed("jq -e 'select(.host == \"evil.example.org\" and .decision == \"blocked\")' /var/log/nixcage-egress/run-*/audit.jsonl")
  '';
}
