# want: api.example.com is not in services.nixcage.egressPolicies."web".inspect. Add "api.example.com" to services.nixcage.egressPolicies."web".inspect
{
  services.nixcage.egressPolicies.web = { allow = [ "*.example.com" ]; inspect = [ "*.example.org" ]; };
  services.nixcage.agents.a = {
    backend = "service"; command = [ "/bin/true" ];
    egress = "web";
    secrets.api = { source = "/run/secrets/api"; env = "API_KEY"; hosts = [ "api.example.com" ]; };
  };
}
