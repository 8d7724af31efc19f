# Shared by the VM tests in checks/vm (this directory is not auto-discovered).
#
# On NixOS a cage sees the host's /usr and /bin (nearly empty) and, at
# /nix/store, the *shared tool store*, not the host's. So every command an
# agent runs comes from a tool release: `publish N` signs the cage-tools
# closure below as generation N and applies it, after which /nix/tools/bin
# holds busybox and curl inside every cage.
{ self }:
{
  # The machine module: the nixcage module, tools whose closure the VM's
  # store holds (so `cagectl release create` can copy them), a release key.
  machine =
    { pkgs, lib, ... }:
    let
      tools = pkgs.buildEnv {
        name = "cage-tools";
        paths = [ pkgs.busybox pkgs.curl ];
      };
      publish = pkgs.writeShellScriptBin "publish" ''
        # publish GENERATION [KEYPREFIX]: sign cage-tools as that generation and apply it.
        set -euo pipefail
        gen=$1 key=''${2:-/var/lib/nixcage-test/release}
        rm -rf /tmp/release-$gen
        cagectl release create ${tools} --key $key.key --channel stable \
          --generation "$gen" --expires 30d --out /tmp/release-$gen
        cagectl apply /tmp/release-$gen
      '';
    in
    {
      imports = [ self.nixosModules.default ];
      services.nixcage.enable = true;
      virtualisation.memorySize = 2048;
      virtualisation.diskSize = 4096;
      system.extraDependencies = [ tools ];
      environment.systemPackages = [ publish pkgs.jq pkgs.curl pkgs.nix ];
      nix.settings.experimental-features = [ "nix-command" ];

      # The release key is made in the test (cagectl key generate) and
      # trusted from here; real hosts ship the public key with their config.
      services.nixcage.store = {
        channel = "stable";
        keys = [ "/var/lib/nixcage-test/release.pub" ];
      };
      users.users.alice = { isNormalUser = true; extraGroups = [ "wheel" ]; };
      users.users.mallory.isNormalUser = true;
      services.nixcage.accounts.ops = { group = "wheel"; role = "admin"; };
    };

  # A one-shot agent: runs script inside the cage (tools from the store),
  # leaves stdout in its workspace, does not start at boot.
  agent = script: {
    backend = "service";
    autostart = false;
    command = [ "/nix/tools/bin/sh" "-c" script ];
  };

  # Test script prelude: boot, make the release key, apply generation 1.
  prelude = ''
    machine.wait_for_unit("multi-user.target")
    machine.wait_for_unit("nixcage-caged.service")
    machine.succeed("mkdir -p /var/lib/nixcage-test && cagectl key generate --out /var/lib/nixcage-test/release")
    machine.succeed("publish 1")
    machine.succeed("test -x /var/lib/nixcage/store/current/bin/curl")
  '';

  # An upstream node standing in for the internet: HTTPS on 443 with a
  # certificate for api.example.com and evil.example.org from a test CA the
  # gateway trusts; it answers 200 and logs every request's headers.
  upstream =
    { pkgs, ... }:
    let
      certs = import ./certs.nix { inherit pkgs; };
      server = pkgs.writeText "echo.py" ''
        import http.server, ssl, sys

        class H(http.server.BaseHTTPRequestHandler):
            def answer(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                with open("/tmp/requests.log", "a") as f:
                    f.write("%s %s %s\n%s\n%s\n" % (self.command, self.headers.get("Host"), self.path, self.headers, body.decode(errors="replace")))
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(b"upstream ok " + self.path.encode() + b"\n")
            do_GET = do_POST = answer

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain("${certs}/server.crt", "${certs}/server.key")
        s = http.server.ThreadingHTTPServer(("0.0.0.0", 443), H)
        s.socket = ctx.wrap_socket(s.socket, server_side=True)
        s.serve_forever()
      '';
    in
    {
      networking.firewall.allowedTCPPorts = [ 443 ];
      systemd.services.echo = {
        wantedBy = [ "multi-user.target" ];
        serviceConfig.ExecStart = "${pkgs.python3}/bin/python3 ${server}";
      };
    };

  # What the machine needs to reach the upstream node by name and trust it.
  trustUpstream =
    { pkgs, nodes, ... }:
    let
      certs = import ./certs.nix { inherit pkgs; };
      ip = nodes.upstream.networking.primaryIPAddress;
    in
    {
      security.pki.certificateFiles = [ "${certs}/ca.crt" ];
      networking.hosts.${ip} = [ "api.example.com" "evil.example.org" ];
    };
}
