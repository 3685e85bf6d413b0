module example.invalid/tollgate/images/pause

go 1.26.0
