# want: services.nixcage.accounts."ops" must set exactly one of user and group (it sets neither)
{ services.nixcage.accounts.ops.role = "viewer"; }
