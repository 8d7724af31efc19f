# want: Invalid host pattern
{
  services.nixcage = {
    enable = true;
    egressPolicies.p.allow = [ "203.0.113.10" ];
    agents.a = { command = [ "/bin/true" ]; egress = "p"; };
  };
}
