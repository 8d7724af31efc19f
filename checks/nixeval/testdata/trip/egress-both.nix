# want: services.nixcage.agents."a" sets both egress = "web" and egressPolicy
{
  services.nixcage.egressPolicies.web.allow = [ "example.com" ];
  services.nixcage.agents.a = {
    backend = "service"; command = [ "/bin/true" ];
    egress = "web";
    egressPolicy.allow = [ "example.org" ];
  };
}
