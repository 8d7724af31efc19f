# want: services.nixcage.agents."a".secrets."api".source = "/nix/store/00000000000000000000000000000000-api-key" is in the Nix store
{
  services.nixcage.egressPolicies.web = { allow = [ "api.example.com" ]; inspect = [ "api.example.com" ]; };
  services.nixcage.agents.a = {
    backend = "service"; command = [ "/bin/true" ];
    egress = "web";
    secrets.api = { source = "/nix/store/00000000000000000000000000000000-api-key"; env = "API_KEY"; hosts = [ "api.example.com" ]; };
  };
}
