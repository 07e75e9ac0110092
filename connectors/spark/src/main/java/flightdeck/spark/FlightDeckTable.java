package flightdeck.spark;

import java.util.EnumSet;
import java.util.Set;
import org.apache.spark.sql.connector.catalog.SupportsRead;
import org.apache.spark.sql.connector.catalog.SupportsWrite;
import org.apache.spark.sql.connector.catalog.TableCapability;
import org.apache.spark.sql.connector.read.ScanBuilder;
import org.apache.spark.sql.connector.write.LogicalWriteInfo;
import org.apache.spark.sql.connector.write.WriteBuilder;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;

/** One flightdeck dataset as a Spark table: batch writes (append, overwrite) and reads. */
final class FlightDeckTable implements SupportsRead, SupportsWrite {
  private final Options options;
  private final StructType schema;

  FlightDeckTable(Options options, StructType schema) {
    this.options = options;
    this.schema = schema;
  }

  @Override
  public String name() {
    return "flightdeck dataset '" + options.dataset() + "'";
  }

  /** The DataFrame's schema (writes) or the dataset's (reads). */
  @Override
  @SuppressWarnings("deprecation") // Spark still asks tables from providers for it.
  public StructType schema() {
    return schema;
  }

  @Override
  public Set<TableCapability> capabilities() {
    return EnumSet.of(
        TableCapability.BATCH_READ, TableCapability.BATCH_WRITE, TableCapability.TRUNCATE);
  }

  @Override
  public WriteBuilder newWriteBuilder(LogicalWriteInfo info) {
    return new FlightDeckWrite.Builder(options, info.schema());
  }

  @Override
  public ScanBuilder newScanBuilder(CaseInsensitiveStringMap map) {
    return new FlightDeckScan.Builder(options, schema);
  }
}
