// Sets the SCRAM-SHA-512 password of a Kafka user through the Admin API
// (what `kafka-configs --alter --add-config SCRAM-SHA-512=[...]` does; that
// tool's jar is not among the broker's). Run by scripts/kafka.sh as a
// single-file program: java -cp 'libs/*' ScramUser.java BOOTSTRAP USER PASSWORD
import java.util.List;
import java.util.Properties;

import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.clients.admin.ScramCredentialInfo;
import org.apache.kafka.clients.admin.ScramMechanism;
import org.apache.kafka.clients.admin.UserScramCredentialUpsertion;

public class ScramUser {
    public static void main(String[] args) throws Exception {
        Properties props = new Properties();
        props.put(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, args[0]);
        try (Admin admin = Admin.create(props)) {
            ScramCredentialInfo info = new ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 4096);
            admin.alterUserScramCredentials(List.of(new UserScramCredentialUpsertion(args[1], info, args[2])))
                .all()
                .get();
        }
    }
}
